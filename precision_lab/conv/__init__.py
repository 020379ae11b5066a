"""Convolution algorithms and native-backend selection (issue 5 fills this in)."""
