"""Small helpers shared by every scaletrain layer (registries, ...). Imports nothing from scaletrain itself."""
