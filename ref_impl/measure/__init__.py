"""measure: see DESIGN.md, "The engine"."""
