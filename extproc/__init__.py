"""kvroute's request path: body -> CBR -> block chain -> index lookup -> decision -> learn/release."""
