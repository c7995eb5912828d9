"""memfit's version, in a module of its own: the derivation cache keys on it, and reading it must not import the
package's public names (memfit/__init__.py)."""

__version__ = "0.1.0"
