;;;; tls.lisp -- the plaintext side of a TLS connection, read with the same
;;;; head checks, limits and body framing as a plain socket.
;;;;
;;;; A TLS connection is served in raw mode: its CONNECTION carries the
;;;; ciphertext, and the layer above wraps it in a TLS stream (cl+ssl).  The
;;;; requests are inside that stream, where the engine's checks cannot see
;;;; them.  So the layer above wraps the TLS stream once more, in a second
;;;; CONNECTION made by MAKE-PLAIN-CONNECTION, whose SOURCE is the TLS
;;;; stream: its input buffer fills from the TLS stream instead of recv(2),
;;;; its output goes to the TLS stream instead of send(2) (FILL-FROM-SOURCE
;;;; and SEND-TO-SOURCE, input.lisp), and everything else is the plain
;;;; code: SCAN-HEAD with its limits (414, 431), CHECK-HEAD (400, 413, 501,
;;;; 505), BEGIN-MESSAGE and the body framing of body.lisp, FINISH-MESSAGE
;;;; between requests (PLAIN-LEAVE-BOUNDARY, stream.lisp).  A refused head is answered through
;;;; the TLS stream, and the connection closes after it.
;;;;
;;;; The differences are in who waits: a plain connection waits in epoll
;;;; between requests and while a head arrives; a TLS connection keeps its
;;;; worker (its cipher state is in cl+ssl's stream), bounded by the idle
;;;; timeout between requests and by the header timeout while a head
;;;; arrives (the READ-DEADLINE of the cipher connection, whose reads the
;;;; TLS stream makes).
;;;;
;;;; Invariants: a plain connection is never in the engine's table or epoll
;;;; set, and is always :ACTIVE; MESSAGE is true while a request's head has
;;;; been checked and its reading has not reached the next boundary.

(in-package #:gallop.core)

(defun make-plain-connection (cipher source &key pending)
  "A CONNECTION that reads and writes the plaintext of SOURCE, the TLS stream
over the connection CIPHER, with the engine's checks (see above).  PENDING,
if given, is a function that says whether SOURCE holds decrypted octets not
read yet (SSL_pending)."
  (let ((c (make-instance 'connection :fd (connection-fd cipher)
                                      :engine (connection-engine cipher)
                                      ;; Its requests count where the
                                      ;; cipher connection's do.
                                      :tally (connection-tally cipher)
                                      :token 0
                                      :remote-address (connection-remote-address cipher)
                                      :remote-port (connection-remote-port cipher))))
    (setf (connection-state c) :active
          (conn-slot c source) source
          (conn-slot c cipher) cipher
          (conn-slot c pending) pending
          (conn-slot c fresh) nil)
    ;; SOURCE is made once the library's handshake is done.
    (tally-add c +tls-handshakes-cell+ 1)
    c))

(defun answer-through-source (c response)
  "Answer the refused request on C with RESPONSE (one of the engine's own
answers) and make C end after it."
  (sb-ext:atomic-incf (engine-rejected (connection-engine c)))
  (note-refusal c response (if (and (ignore-errors (send-to-source c response 0 (length response)) t)
                                    (not (conn-slot c gone)))
                               (length response)
                               0))
  (setf (request-close-after (connection-request c)) t)
  nil)

(defun call-with-header-deadline (cipher function)
  "Call FUNCTION with the reads of the connection CIPHER bounded by the
header timeout in all: for a TLS handshake and for a request head read
through TLS, so that a client that dribbles either cannot hold the worker
past it (a plain connection's head waits in epoll instead)."
  (setf (conn-slot cipher read-deadline)
        (+ (now-ms) (engine-header-timeout-ms (connection-engine cipher))))
  (unwind-protect (funcall function)
    (setf (conn-slot cipher read-deadline) 0)))

(defun read-next-head (c)
  "Read the next request head on the plain connection C until it is
complete and checked, then begin its message: true.  NIL when there is none
\(end of file) or it was refused (answered here): C then ends."
  (let* ((cipher (conn-slot c cipher))
         (engine (connection-engine c)))
    (call-with-header-deadline
     cipher
     (lambda ()
         (loop
           (let ((status (scan-head c)))
             (case status
               (:complete
                (let ((refusal (check-head c)))
                  (when refusal
                    (return (answer-through-source c (error-response refusal))))
                  (begin-message c)
                  (setf (request-message (connection-request c)) t)
                  (return t)))
               (:line-too-long (return (answer-through-source c +response-414+)))
               (:too-large (return (answer-through-source c +response-431+)))
               (:incomplete
                (let ((refusal (check-partial-head c)))
                  ;; A line no header can make valid: refused now.
                  (when refusal
                    (return (answer-through-source c (error-response refusal)))))
                (unless (make-room c (engine-max-head-bytes engine))
                  ;; Full: at the head limit (431), or short of it because
                  ;; the head budget is spent (503), as on a plain socket.
                  (return (answer-through-source
                           c (if (< (length (the octets (conn-slot c inbuf)))
                                    (engine-max-head-bytes engine))
                                 (response-503 engine)
                                 +response-431+))))
                (unless (handler-case (fill-from-source c)
                          (connection-timeout-error () nil)) ; the 408 below
                  (when (and (< (conn-slot c in-start) (conn-slot c in-end))
                             (>= (now-ms) (conn-slot cipher read-deadline)))
                    ;; Part of a head, and its time ran out.
                    (sb-ext:atomic-incf (engine-timeouts engine))
                    (answer-through-source c +response-408+))
                  (return nil))))))))))
