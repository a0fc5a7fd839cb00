"""What the browser tests share: headless Chromium (Debian's chromium + chromedriver) driven by selenium, and
bounded waits. scripts/test-browser installs both and runs each test file against its own swarm."""

import shutil

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

POLL = 0.1


def executable(*names):
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"none of {names} found: apt-get install chromium chromium-driver")


@pytest.fixture(scope="module")
def browser():
    options = Options()
    options.binary_location = executable("chromium", "chromium-browser")
    for arg in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,800", "--force-device-scale-factor=1", "--lang=en-US"]:
        options.add_argument(arg)
    # The driver from Debian's chromium-driver: selenium must not look for (or download) another one.
    driver = webdriver.Chrome(service=Service(executable_path=executable("chromedriver")), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def wait(driver, seconds, condition, message):
    return WebDriverWait(driver, seconds, poll_frequency=POLL).until(condition, message)
