"""fashionapp: a second Flower app for the Flower-app benchmark."""
