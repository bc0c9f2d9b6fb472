;;;; chat.lisp -- WebSockets on the native API: an echo at /ws/echo and a
;;;; chat room a browser can use at /chat (its WebSocket: /ws/chat), and the
;;;; server's metrics at /gallop/metrics.  No thread per client: between
;;;; messages each WebSocket waits in epoll.
;;;;
;;;;   scripts/lisp.sh --load examples/chat.lisp --eval '(gallop-example-chat:main)'
;;;;   open http://127.0.0.1:4243/chat in two windows
;;;;
;;;; `make serve` runs it beside the drop-in example.  (tests/native/chat.lisp
;;;; checks it with raw frames, and with two pages of headless Chromium.)

(unless (find-package "GALLOP")         ; (loaded already by the tests)
  (asdf:load-system "gallop/native"))

(defpackage #:gallop-example-chat
  (:use #:common-lisp)
  (:export #:chat-app #:members #:main))
(in-package #:gallop-example-chat)

(defvar *members* '() "The WebSockets in the room.")
(defvar *lock* (sb-thread:make-mutex :name "chat members"))

(defun members ()
  (sb-thread:with-mutex (*lock*) (copy-list *members*)))

(defun say (text)
  "Send TEXT to everyone in the room, from this worker, without waiting for
any of them: a member that does not read only delays itself."
  (dolist (ws (members))
    (gallop:ws-send ws text)))

(defparameter +page+ "<!doctype html>
<html><head><meta charset='utf-8'><title>Gallop chat</title></head>
<body style='font-family: sans-serif; max-width: 40em; margin: 2em auto'>
<h1>Chat</h1>
<ul id='log'></ul>
<form id='form'><input id='text' autocomplete='off' placeholder='say something'>
<button>Send</button></form>
<script>
const log = document.getElementById('log');
const socket = new WebSocket(`ws://${location.host}/ws/chat`);
socket.onmessage = (event) => {
  const item = document.createElement('li');
  item.textContent = event.data;
  log.appendChild(item);
};
socket.onopen = () => { document.body.dataset.open = 'yes'; };
document.getElementById('form').onsubmit = (event) => {
  event.preventDefault();
  const text = document.getElementById('text');
  socket.send(text.value);
  text.value = '';
};
</script>
</body></html>")

(defun chat-app (env)
  (let ((path (getf env :path-info)))
    (cond ((and (string= path "/ws/echo") (gallop:websocket-request-p env))
           (gallop:accept-websocket env :deflate t
                                        :on-message (lambda (ws message) (gallop:ws-send ws message))))
          ((and (string= path "/ws/chat") (gallop:websocket-request-p env))
           (gallop:accept-websocket
            env
            :deflate t
            :on-open (lambda (ws)
                       (sb-thread:with-mutex (*lock*) (push ws *members*))
                       (say (format nil "~D here" (length (members)))))
            :on-message (lambda (ws message) (declare (ignore ws)) (say message))
            :on-close (lambda (ws code reason)
                        (declare (ignore code reason))
                        (sb-thread:with-mutex (*lock*)
                          (setf *members* (remove ws *members*))))))
          ((string= path "/chat")
           `(200 (:content-type "text/html; charset=utf-8") (,+page+)))
          ((string= path "/gallop/metrics") (gallop:metrics-app env))
          (t '(404 (:content-type "text/plain") ("Not found"))))))

(defun main (&key (port 4243))
  "Serve CHAT-APP on 127.0.0.1:PORT; returns the server (GALLOP:STOP stops it)."
  (gallop:start #'chat-app :address "127.0.0.1" :port port))
