"""Integrations of pdactors with inference engines; each subpackage owns one engine's imports."""
