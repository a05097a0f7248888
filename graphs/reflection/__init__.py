"""Reflection example app: an assistant answers and a judge critiques until the judge calls `Finish`."""
