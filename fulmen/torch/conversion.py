"""Torch language: conversion (being written)."""
