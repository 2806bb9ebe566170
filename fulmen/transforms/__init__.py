"""Trace-to-trace transforms: dead-code elimination, CSE, deleting last uses, autodiff, rematerialization."""
