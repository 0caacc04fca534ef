"""A trivial Flower app for measuring the SuperLink."""
