"""The audit engine: one prepared measurement, one audit point per noise sigma; run, sweep and calibrate go through it."""
