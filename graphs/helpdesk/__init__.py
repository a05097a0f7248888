"""Helpdesk example app: a drafter and a reviewer answer shop customers; trained from task files and a judge."""
