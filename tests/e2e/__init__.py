"""End-to-end tests: tiny real checkpoints, live servers, the openai SDK."""
