"""What a run trains on: datasets (built-in and user files) and chat prompts."""
