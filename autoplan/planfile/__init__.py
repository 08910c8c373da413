"""The plan document and its JSON form."""
