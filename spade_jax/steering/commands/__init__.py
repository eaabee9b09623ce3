"""The Routes of Reasoning commands (`python -m spade_jax.steer read|identify|run`): each
phase of the protocol as a resumable command writing Markdown/CSV tables and PNG plots."""
