"""Where the configuration files are: conf/ (Hydra's config directory) and recipes/ (the `recipe` group).

A leaf module, so that both the registry (which stores the recipes) and compose.py (which points Hydra
at conf/) can import it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
RECIPES_DIR = CONF_DIR.parent / "recipes"
