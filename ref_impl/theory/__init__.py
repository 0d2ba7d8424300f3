"""theory: see DESIGN.md, "The engine"."""
