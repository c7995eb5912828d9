"""Node kinds, one module per family of kinds; importing a module registers its handlers."""
