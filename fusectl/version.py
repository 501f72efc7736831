"""The fusectl version, in a module of its own so any room can read it without importing the
package's public API (which imports every room)."""

__version__ = "0.1.0"
