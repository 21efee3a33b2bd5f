"""Model weights: where a profile's come from (``source``) and fetching them into a
node's weights directory, whole and verified (``fetch``)."""
