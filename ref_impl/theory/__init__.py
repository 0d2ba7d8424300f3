"""theory: first principles in numpy, what the measurements are set against. The one table of model shapes
(shapes), the roofline (roofline), memory signalling (signalling), PCIe and Thunderbolt links (interconnect), the
GPU command queue (queue) and speculative decoding's speedup (speedup). Importable from every layer; imports only
itself and viz."""
