"""The client side: admission, the executors of the core's plans (POST, GET, DELETE), views and relays."""
