"""digitsapp: a Flower / PyTorch app on scikit-learn's digits."""
