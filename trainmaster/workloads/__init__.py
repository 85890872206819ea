"""Training programs shipped with Trainmaster for demos and examples (real training, small data)."""
