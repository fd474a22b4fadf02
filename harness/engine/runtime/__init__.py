"""The engine's runtime core: the Engine, its serving loop, caches, collectives and construction."""
