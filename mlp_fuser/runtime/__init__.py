"""Host-time shortcuts under the ops: recorded launch plans and Inductor's direct call."""
