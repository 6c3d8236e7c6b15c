"""The optimizers (AdamW, Muon) and the learning-rate schedules."""
