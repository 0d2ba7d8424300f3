"""platform: see DESIGN.md, "The engine"."""
