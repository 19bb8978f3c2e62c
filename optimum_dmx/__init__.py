"""optimum-dmx: differentiable mixed-precision assignment of OCP microscaling (MX) float formats."""

__version__ = "0.1.0.dev0"
