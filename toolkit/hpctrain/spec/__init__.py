"""The request: typed, frozen, validated dataclasses (each rule once), site profiles, model presets. Torch-free."""
