"""formats: see DESIGN.md, "The engine"."""
