;;;; websocket-runner.lisp -- the WebSocket corpus (websocket-corpus.lisp)
;;;; against a server: each case on a new WebSocket, sent whole or one octet
;;;; at a time, and what came back described the way its expectation is, so
;;;; that a difference reads as one line.

(in-package #:gallop-tests)

(in-suite conformance)

(defun describe-payload (payload)
  (if (<= (length payload) 12)
      (format nil "~(~{~2,'0x~}~)" (coerce payload 'list))
      (format nil "~D octets ~A" (length payload)
              (subseq (hex (gallop::sha1 (coerce payload 'octets-vector))) 0 8))))

(defun describe-expected (expected &key library)
  "EXPECTED (a corpus case's) as a list of strings; for a LIBRARY, whose end of
the connection is not waited for, without it."
  (loop for item in expected
        append (ecase (first item)
                 (:frame (list (format nil "~D ~A" (second item) (describe-payload (third item)))))
                 (:close (if library
                             (list (format nil "close ~D" (second item)))
                             (list (format nil "close ~D" (second item)) "end")))
                 (:end (if library '() (list "end"))))))

(defun read-server-frame (socket timeout)
  "The next frame from SOCKET as (OPCODE PAYLOAD), :END at end of file, or
:TIMEOUT."
  (let ((head (read-octets socket 2 :timeout timeout)))
    (cond ((zerop (length head)) (if (closed-by-peer-p socket :timeout 0.1) :end :timeout))
          ((< (length head) 2) :end)
          (t (let* ((short (logand (aref head 1) 127))
                    (extended (case short (126 (read-octets socket 2)) (127 (read-octets socket 8))))
                    (length (if extended
                                (reduce (lambda (n b) (logior (ash n 8) b)) extended :initial-value 0)
                                short))
                    (payload (read-octets socket length :timeout timeout)))
               (list (logand (aref head 0) 15) payload))))))

(defun observe-case (port path client expected &key one-by-one library (timeout 3))
  "Run one case on a new WebSocket at PORT's PATH: what came back, described
as DESCRIBE-EXPECTED describes EXPECTED, item for item."
  (let ((socket (connect port)))
    (unwind-protect
         (progn
           (send socket (ws-handshake path))
           (multiple-value-bind (status) (read-ws-head socket)
             (unless (eql status 101)
               (return-from observe-case (list (format nil "handshake answered ~A" status)))))
           (let ((client (coerce client 'octets-vector)))
             (if (and one-by-one (> (length client) 4096))
                 ;; Large ones in odd pieces: octet by octet takes too long.
                 (loop for start from 0 below (length client) by 997
                       do (ws-send socket (subseq client start (min (length client) (+ start 997)))))
                 (ws-send socket client :one-by-one one-by-one)))
           (loop with wanted = (describe-expected expected :library library)
                 repeat (length wanted)
                 for item in wanted
                 for got = (if (string= item "end")
                               (if (closed-by-peer-p socket :timeout 5) "end" "open")
                               (let ((frame (read-server-frame socket timeout)))
                                 (case frame
                                   (:end "end")
                                   (:timeout (format nil "nothing in ~D s" timeout))
                                   (t (if (= 8 (first frame))
                                          (let ((p (second frame)))
                                            (if (>= (length p) 2)
                                                (format nil "close ~D" (logior (ash (aref p 0) 8) (aref p 1)))
                                                (format nil "8 ~A" (describe-payload p))))
                                          (format nil "~D ~A" (first frame)
                                                  (describe-payload (second frame))))))))
                 collect got
                 until (member got '("end") :test #'string=)))
      (usocket:socket-close socket))))

(defun run-ws-corpus (port path &key library (corpus *ws-corpus*))
  "Each case of CORPUS against PORT's PATH, whole and one octet at a time:
a list of (ID MODE EXPECTED GOT) for the cases where what came back was not
what the case expects."
  (loop for (id nil nil client expected) in corpus
        append (loop for one-by-one in '(nil t)
                     for got = (observe-case port path client expected
                                             :one-by-one one-by-one :library library)
                     for wanted = (describe-expected expected :library library)
                     unless (equal got wanted)
                       collect (list id (if one-by-one :octets :whole) wanted got))))

;;; The tests.  The native API answers every case as RFC 6455 says.  The
;;; libraries answer some their own way (doc/websocket-conformance.md):
;;; those answers are recorded below, and each must come back the same on
;;; Gallop, whole and one octet at a time, so that Gallop's transport
;;; changes nothing of what a library does.

(defparameter *websocket-driver-answers*
  '(("7.1.1" "close 1000")                ; a close without code answered with 1000
    ("7.5.1" "end"))                      ; a bad UTF-8 reason ends the connection
  "Where websocket-driver on Clack :gallop answers otherwise than RFC 6455 says.")

(defparameter *hunchensocket-answers*
  `(("1.1.6" "close 1009")                ; its 64 KiB fragment limit
    ,@(loop for id in '("1.2.1" "1.2.2" "1.2.3" "1.2.4" "5.5" "6.9" "9.1")
            collect (list id "close 1003")) ; binary refused by default
    ;; It keeps the first message's opcode: what follows a text is text.
    ("1.2.5" "1 61" "1 01")               ; a binary after a text, echoed as text
    ("4.1.2" "1 6f6b" "1 01")             ; opcode 7 after a text, echoed as text
    ("6.5" "close 1011")                  ; past U+10FFFF: an internal error
    ("7.3.1" "8 03")                      ; a one-octet close echoed
    ("7.5.1" "close 1000")                ; a bad UTF-8 reason not checked
    ,@(loop for code in '(0 999 1004 1005 1006 1016 1100 2000 2999 5000 65535)
            collect (list (format nil "7.9.~D" code) (format nil "close ~D" code))) ; echoed
    ("9.2" "close 1009"))                 ; its 1 MiB message limit
  "Where hunchensocket on Gallop answers otherwise than RFC 6455 says.")

(defun check-answers (misses answers what)
  "MISSES (RUN-WS-CORPUS's) are exactly ANSWERS, in both modes."
  (let ((expected (loop for (id . got) in answers
                        append (list (list id :whole got) (list id :octets got))))
        (found (loop for (id mode nil got) in misses collect (list id mode got))))
    (is (null (set-difference found expected :test #'equal))
        "~A answered otherwise than recorded: ~{~%  ~S~}" what
        (set-difference found expected :test #'equal))
    (is (null (set-difference expected found :test #'equal))
        "~A now answers as RFC 6455 says (update the record): ~{~%  ~S~}" what
        (set-difference expected found :test #'equal))))

(test websocket-corpus-native
  "Every case of the corpus, whole and one octet at a time, answered by the
native API exactly as RFC 6455 says."
  (with-app (server #'native-ws-app)
    (let ((misses (run-ws-corpus (native-port server) "/echo")))
      (is (null misses) "~{~%  ~S~}" misses))))

(test websocket-corpus-libraries
  "websocket-driver on Clack :gallop and hunchensocket on both Hunchentoot
front ends answer every case as recorded, whole and one octet at a time."
  (with-ws-child ()
    (destructuring-bind (clack easy taskmaster capped) *ws-ports*
      (declare (ignore capped))
      (check-answers (run-ws-corpus clack "/echo" :library t) *websocket-driver-answers*
                     "websocket-driver")
      (check-answers (run-ws-corpus easy "/echo" :library t) *hunchensocket-answers*
                     "hunchensocket on the easy-acceptor")
      (check-answers (run-ws-corpus taskmaster "/echo" :library t) *hunchensocket-answers*
                     "hunchensocket with gallop:taskmaster"))))
