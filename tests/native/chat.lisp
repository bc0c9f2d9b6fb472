;;;; chat.lisp -- examples/chat.lisp (what `make serve` serves on port 4243):
;;;; its echo and chat room with raw frames, byte by byte, and its /chat page
;;;; in two pages of Debian's headless Chromium: a message sent in one
;;;; arrives in the other.

(in-package #:gallop-tests)

(in-suite native)

(eval-when (:compile-toplevel :load-toplevel :execute)
  (load (merge-pathnames "examples/chat.lisp" (asdf:system-source-directory "gallop"))))

(defun chat-socket (port path)
  (let ((socket (connect port)))
    (send socket (ws-handshake path))
    (expect-octets socket (exact-101) "the 101")
    socket))

(test chat-example-frames
  "/ws/echo echoes; in /ws/chat each member hears who is here and what
anyone says, in order."
  (with-app (server #'gallop-example-chat:chat-app)
    (let* ((port (native-port server))
           (echo (chat-socket port "/ws/echo")))
      (unwind-protect
           (progn (ws-send echo (ws-frame 1 (octets "hello")))
                  (expect-octets echo (server-frame 1 (octets "hello")) "echo"))
        (usocket:socket-close echo))
      (let ((a (chat-socket port "/ws/chat")))
        (unwind-protect
             (progn
               (expect-octets a (server-frame 1 (octets "1 here")) "a alone")
               (let ((b (chat-socket port "/ws/chat")))
                 (unwind-protect
                      (progn
                        (expect-octets a (server-frame 1 (octets "2 here")) "a hears b")
                        (expect-octets b (server-frame 1 (octets "2 here")) "b hears itself")
                        (ws-send b (ws-frame 1 (octets "hi all")))
                        (expect-octets a (server-frame 1 (octets "hi all")) "a hears b say")
                        (expect-octets b (server-frame 1 (octets "hi all")) "b hears itself say"))
                   (usocket:socket-close b))))
          (usocket:socket-close a)))
      (is (wait-until (lambda () (null (gallop-example-chat:members))))))))

(test chat-page-in-chromium
  "The /chat page in two pages of headless Chromium: what one sends with the
page's form shows in the other's log."
  (with-app (server #'gallop-example-chat:chat-app)
    (let ((lines (python-websockets "chromium-chat.py" (native-port server))))
      (is (= 1 (length lines)) "~{~A~%~}" lines)
      (is (and (uiop:string-prefix-p "B saw: " (first lines))
               (search "2 here" (first lines))
               (uiop:string-suffix-p (first lines) "|hello from A"))
          "~A" (first lines)))))
