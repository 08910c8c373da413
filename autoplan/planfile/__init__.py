"""The plan document: the `Plan` (`schema`) and its sections (`sections`), its JSON form (`io`),
how a solved problem becomes one (`assemble`) and how it is shown (`show`, `picture`). Modules
of the package import one another, never this file."""
