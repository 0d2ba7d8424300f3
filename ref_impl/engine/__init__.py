"""engine: see DESIGN.md, "The engine"."""
