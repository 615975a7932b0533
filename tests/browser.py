"""Headless Chromium for the page's tests: Debian's `chromium` and `chromedriver`, driven by selenium.

Without them the browser tests skip, unless LLMACCEL_REQUIRE_BROWSER is set (.ci/run sets it and
installs the packages), where a missing browser fails them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest


def chromium() -> tuple[str, str]:
    """(browser, driver) paths, or a skip (a failure under LLMACCEL_REQUIRE_BROWSER)."""
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    message = "Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
    if os.environ.get("LLMACCEL_REQUIRE_BROWSER"):
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def headless_chromium(width: int = 1280, height: int = 900) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}", "--lang=en-US"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver, allowed: Callable[[str], bool] = lambda message: False) -> list[str]:
    """The console's errors since the last call (the log is drained by reading it)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE" and not allowed(e["message"])]

