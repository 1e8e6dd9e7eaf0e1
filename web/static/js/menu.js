// The top bar's menu on narrow screens, where the navigation folds behind one button. The
// stylesheet shows the menu while the button's aria-expanded is "true", so the state a screen
// reader announces and the state on screen cannot disagree. The button is a real <button>
// (Enter and Space work); Escape closes the menu and gives the button its focus back, and the
// menu also closes when focus or a click goes elsewhere.
const button = document.getElementById('menu-button');
const menu = document.getElementById('menu');

function setOpen(open) {
  button.setAttribute('aria-expanded', String(open));
}

const isOpen = () => button.getAttribute('aria-expanded') === 'true';

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
