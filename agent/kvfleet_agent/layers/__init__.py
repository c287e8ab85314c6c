"""Building blocks of the models: linear, attention, norm, rotary and embedding layers."""
