"""training: the corpus (corpus), the loss on held-out text (evaluate), the one training loop and its log (loop),
the shipped models (models) and MTP heads on a frozen model (heads). See README.md, "Layout"."""
