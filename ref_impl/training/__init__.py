"""training: see DESIGN.md, "The engine"."""
