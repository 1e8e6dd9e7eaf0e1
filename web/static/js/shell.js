// What every page shares, beside its own module: the top bar's menu and the phone's lists.
//
// On narrow screens the navigation folds behind one button. The stylesheet shows the menu while
// the button's aria-expanded is "true", so the state a screen reader announces and the state on
// screen cannot disagree. The button is a real <button> (Enter and Space work); Escape closes the
// menu and gives the button its focus back, and the menu also closes when focus or a click goes
// elsewhere.
//
// On a phone a `table.list` is shown as a list, a row per block (app.css); each cell then says
// which column it is through `data-label`, copied here from the table's header whenever a page
// draws or redraws a table.
const button = document.getElementById('menu-button');
const menu = document.getElementById('menu');

const isOpen = () => button.getAttribute('aria-expanded') === 'true';

function setOpen(open) {
  button.setAttribute('aria-expanded', String(open));
}

if (button && menu) {
  button.addEventListener('click', () => setOpen(!isOpen()));
  document.addEventListener('keydown', (event) => {
    if (event.key === 'Escape' && isOpen()) {
      setOpen(false);
      button.focus();
    }
  });
  document.addEventListener('click', (event) => {
    if (isOpen() && !button.contains(event.target) && !menu.contains(event.target)) setOpen(false);
  });
  menu.addEventListener('focusout', (event) => {
    const next = event.relatedTarget;
    if (isOpen() && next && !menu.contains(next) && next !== button) setOpen(false);
  });
}

function labelCells(table) {
  const heads = [...(table.tHead?.rows[0]?.cells || [])].map((th) => th.textContent.trim());
  for (const body of table.tBodies) {
    for (const row of body.rows) {
      [...row.cells].forEach((cell, i) => {
        if (heads[i] && cell.dataset.label !== heads[i]) cell.dataset.label = heads[i];
      });
    }
  }
}

function labelTables() {
  for (const table of document.querySelectorAll('table.list')) labelCells(table);
}

// Only added and removed nodes are watched, so setting the labels does not call this again.
new MutationObserver(labelTables).observe(document.body, { childList: true, subtree: true });
labelTables();
