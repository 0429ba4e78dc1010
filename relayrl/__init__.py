"""relayrl is a PyTorch-native RL post-training system for language models.

The layers are its subpackages (their order is in DESIGN.md). This file only names the version: it must
never import a subpackage, so importing one layer never loads another.
"""

__version__ = "0.1.0"
