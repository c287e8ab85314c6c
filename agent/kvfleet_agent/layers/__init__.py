"""Building blocks of the models: linear, attention, norm, rotary, embedding layers and their tensor-parallel group."""
