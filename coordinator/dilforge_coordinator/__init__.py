"""Runs the stages of a pipeline in order; imports only dilforge_shared, never a service."""
