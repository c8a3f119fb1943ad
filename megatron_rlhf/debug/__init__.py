"""Tools for exercising the package's failure paths; nothing here acts unless a test arms it."""
