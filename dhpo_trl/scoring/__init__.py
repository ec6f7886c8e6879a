"""Scoring model text: the math reward (`math_verify_reward`, bounded in time and memory), the grader core, gold
normalisation and the math training data."""
