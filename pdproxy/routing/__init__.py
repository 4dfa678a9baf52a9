"""Routing: choose producer and consumer backends for a request."""
