"""What a run writes and reads back: its output folder (one run per folder, the roles of the folders it is given, the
manifest of what it wrote), checkpoints and what a resume accepts, validation images, metrics and profiles, the model
card and the end summary."""
