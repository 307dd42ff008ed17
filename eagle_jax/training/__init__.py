"""Training EAGLE draft heads: data, objectives, trainer."""
