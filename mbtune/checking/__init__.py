"""The check's wing: one configuration's pipelined update held to the plain model's."""
