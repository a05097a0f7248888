"""Support example app: a customer chat on one thread, with refunds a human supervisor approves."""
