"""Model card templates of optimum-dmx (package data, installed as ``optimum_dmx.model_cards``)."""
